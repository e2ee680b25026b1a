//! Tensor parallelism: one layer split over the GPUs of one host, and what each GPU then holds.
//!
//! A layer splits `gpus` ways by its KV heads and by its ffn columns. Each GPU takes whole KV heads
//! with their query heads (whole groups, so its attention reads only its own cache) and an equal run
//! of ffn columns: its rows of Wq, Wk, Wv, Wgate and Wup (column-parallel) and the matching columns of
//! Wo and Wdown (row-parallel), whose products are then partial sums of every output, added across the
//! GPUs in rank order. The norms, the layer's input and its output are whole on every GPU. One GPU's
//! share is therefore a layer of the same shape family with `n_q / gpus`, `n_kv / gpus` and
//! `ffn / gpus`: [`shard`] is that configuration, and its byte model ([`crate::bytes`]) is that GPU's
//! bytes, for the floor (each GPU's bytes over its own bandwidth) and for the memory it must hold.

use crate::{Config, SpecError};

/// The most GPUs a layer splits over: the GPUs of one host (an HGX board has eight).
pub const MAX_GPUS: usize = 8;

/// One GPU's share of every layer of `cfg` split `gpus` ways (`gpus` = 1: `cfg` itself). Refused, with
/// the reason, where the KV heads or the ffn columns do not split into equal shares the kernels take.
pub fn shard(cfg: &Config, gpus: usize) -> Result<Config, SpecError> {
    let refuse = |reason: String| Err(SpecError::Unsplittable { name: cfg.name.clone(), gpus, reason });
    if !(1..=MAX_GPUS).contains(&gpus) {
        return refuse(format!("a layer splits over the GPUs of one host, 1 to {MAX_GPUS}"));
    }
    if !cfg.n_kv.is_multiple_of(gpus) {
        return refuse(format!(
            "its {} KV heads do not split into {gpus} equal shares of whole heads (each GPU attends over its own)",
            cfg.n_kv
        ));
    }
    let ffn = cfg.ffn / gpus;
    if !cfg.ffn.is_multiple_of(gpus) || !ffn.is_multiple_of(8) {
        return refuse(format!(
            "ffn = {} does not split into {gpus} equal shares of whole 16-byte vectors (8 columns)",
            cfg.ffn
        ));
    }
    Ok(Config { n_q: cfg.n_q / gpus, n_kv: cfg.n_kv / gpus, ffn, ..cfg.clone() })
}

/// Device bytes each GPU holds for a run of `calls` calls with every layer split `gpus` ways: its share
/// of every layer's weights and caches, the norms, and every call's input and output whole
/// ([`crate::bytes::data_bytes`] of the [`shard`]).
pub fn bytes_per_gpu(cfg: &Config, gpus: usize, calls: usize) -> Result<u64, SpecError> {
    let share = shard(cfg, gpus)?;
    crate::bytes::data_bytes(&share, calls).ok_or(SpecError::TooLarge { bytes: None, limit: crate::MAX_DEVICE_BYTES })
}

/// The fewest GPUs, of the counts the layer splits into, whose shares each fit `device_bytes`; `None`
/// where no count up to [`MAX_GPUS`] does.
pub fn fewest_gpus(cfg: &Config, device_bytes: u64, calls: usize) -> Option<usize> {
    (1..=MAX_GPUS).find(|&g| bytes_per_gpu(cfg, g, calls).is_ok_and(|b| b <= device_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bytes::{ByteModel, data_bytes};
    use crate::family::{find, find_stack};

    fn stack_405b() -> Config {
        find_stack("stack-405b").unwrap().config()
    }

    /// The H200's device memory (150.1 GB), as the device machine reports it.
    const H200_BYTES: u64 = 150_100_000_000;

    #[test]
    fn one_gpu_is_the_layer_itself() {
        for m in crate::family::FAMILY {
            assert_eq!(shard(&m.config(), 1).unwrap(), m.config(), "{}", m.name);
        }
    }

    /// Every GPU holds 1/gpus of every matrix and of the caches, and the norms, the input and the
    /// output whole: the shares' bytes add up to the layer's plus the copies of what is whole.
    #[test]
    fn the_shares_tile_the_layer_and_repeat_only_what_is_whole() {
        for cfg in [find_stack("stack-70b").unwrap().config(), stack_405b(), find("qwen-32b").unwrap().config()] {
            let whole = ByteModel::of(&cfg);
            let calls = crate::schedule::call_count(&cfg).unwrap();
            for gpus in [2, 4, 8] {
                let share = shard(&cfg, gpus).unwrap();
                share.validate().unwrap_or_else(|e| panic!("{} / {gpus}: {e}", cfg.name));
                let one = ByteModel::of(&share);
                assert_eq!(one.matrices * gpus as u64, whole.matrices, "{} / {gpus}", cfg.name);
                assert_eq!(one.norms, whole.norms);
                let per_gpu = bytes_per_gpu(&cfg, gpus, calls).unwrap();
                let io = data_bytes(&cfg, calls).unwrap() - data_bytes(&cfg, 0).unwrap();
                let repeated = (gpus as u64 - 1) * (whole.norms * cfg.layers as u64 + io);
                assert_eq!(per_gpu * gpus as u64, data_bytes(&cfg, calls).unwrap() + repeated, "{} / {gpus}", cfg.name);
            }
        }
    }

    /// A 70B stack fits one H200 and a 405B one (about 805 GB in bf16) needs eight: four hold 201 GB
    /// each, and six or seven do not split its 8 KV heads.
    #[test]
    fn the_405b_stack_needs_eight_h200s_and_the_70b_one_fits_one() {
        let big = stack_405b();
        let calls = crate::schedule::call_count(&big).unwrap();
        let gb = |gpus| bytes_per_gpu(&big, gpus, calls).unwrap() as f64 / 1e9;
        assert!((800.0..810.0).contains(&gb(1)), "{}", gb(1));
        assert!((200.0..202.0).contains(&gb(4)), "{}", gb(4));
        assert!((100.0..101.5).contains(&gb(8)), "{}", gb(8));
        assert_eq!(fewest_gpus(&big, H200_BYTES, calls), Some(8));
        let seventy = find_stack("stack-70b").unwrap().config();
        assert_eq!(fewest_gpus(&seventy, H200_BYTES, crate::schedule::call_count(&seventy).unwrap()), Some(1));
        assert_eq!(fewest_gpus(&big, 50_000_000_000, calls), None, "over 8 GPUs of 50 GB");
    }

    /// docs/parallel.md's table: a token's bytes per GPU, and its floor at 4.2 TB/s.
    #[test]
    fn the_floor_per_gpu_is_the_shares_bytes() {
        let seventy = find_stack("stack-70b").unwrap().config();
        // A GPU's bytes a token, the floor's numerator: its share's byte model.
        let token_bytes = |cfg: &Config, gpus| ByteModel::stack(&shard(cfg, gpus).unwrap()).total;
        let gb = |cfg: &Config, gpus| token_bytes(cfg, gpus) as f64 / 1e9;
        for (gpus, want) in [(1, 138.26), (2, 69.13), (4, 34.57), (8, 17.29)] {
            assert!((gb(&seventy, gpus) - want).abs() < 0.01, "{gpus} GPUs: {}", gb(&seventy, gpus));
        }
        assert!((gb(&stack_405b(), 8) - 100.70).abs() < 0.01, "{}", gb(&stack_405b(), 8));
        let floor_ms = token_bytes(&seventy, 8) as f64 / 4.2e12 * 1e3;
        assert!((floor_ms - 4.12).abs() < 0.005, "{floor_ms}");
    }

    #[test]
    fn splits_that_cut_a_head_or_a_vector_are_refused_naming_why() {
        let graded = Config::graded();
        let said = |cfg: &Config, gpus| shard(cfg, gpus).unwrap_err().to_string();
        assert!(said(&graded, 3).contains("8 KV heads do not split into 3"), "{}", said(&graded, 3));
        assert!(said(&graded, 0).contains("1 to 8"));
        assert!(said(&graded, 16).contains("1 to 8"));
        let odd_ffn = Config { ffn: 8 * 3, ..Config::tiny() };
        assert!(said(&odd_ffn, 2).contains("ffn = 24 does not split into 2"), "{}", said(&odd_ffn, 2));
        // Every member of the family splits two ways; the multi-head 13B's 40 KV heads eight ways, GLM's
        // two not four.
        for m in crate::family::FAMILY {
            assert!(shard(&m.config(), 2).is_ok(), "{}", m.name);
        }
        assert!(shard(&find("llama-2-13b").unwrap().config(), 8).is_ok());
        assert!(shard(&find("glm-4-9b").unwrap().config(), 4).is_err(), "2 KV heads");
    }
}
