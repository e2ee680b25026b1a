//! The layer's shape and the run's schedule: the graded configuration of the task (`docs/task.md`) and
//! small named configurations for tests, with validation that names the offending field and bounds
//! every size by what a device could hold, so nothing downstream can overflow.

use serde::{Deserialize, Serialize};

use crate::SpecError;

/// One decoder layer's dimensions and the run's schedule. Every field is normative for its config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Name shown in reports (`graded`, `tiny`, `small`, or the file a config came from).
    pub name: String,
    /// Layers in the stack: 1 for the task's layer and every member of the family; the named stacks
    /// (`crate::family::STACKS`) have 16 to 80, which `grader run` judges as a whole, layer by layer
    /// (what studies one layer refuses them: [`Config::require_one_layer`]).
    pub layers: usize,
    /// Hidden size.
    pub d: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// Query heads.
    pub n_q: usize,
    /// Key/value heads (grouped-query attention: `n_q / n_kv` query heads share one).
    pub n_kv: usize,
    /// Head dimension.
    pub hd: usize,
    /// RMSNorm epsilon, inside the square root.
    pub eps: f32,
    /// RoPE base.
    pub theta: f64,
    /// Batch size; the task is batch 1.
    pub batch: usize,
    /// Cached positions filled before the first step: slots `[0, prefill)`.
    pub prefill: usize,
    /// Cache capacity in positions.
    pub max_seq_len: usize,
    /// Timed decode steps, at positions `prefill ..`.
    pub timed_steps: usize,
    /// Untimed steps compared before timing starts, at positions `prefill ..`.
    pub correctness_steps: usize,
}

/// Names accepted by [`Config::named`], in the order `--help` lists them.
pub const CONFIG_NAMES: [&str; 3] = ["graded", "small", "tiny"];

/// The most layers a stack may have: the deepest Llama-family models have 126.
pub const MAX_LAYERS: usize = 128;

/// The largest value of any size field, and of `n_q * hd`: the C ABI passes sizes as int32
/// (`submission/include/persistent_layer.h`) and the kernels index rows with 32-bit integers.
pub const MAX_SIZE: usize = i32::MAX as usize;

/// The most device memory one copy of a run's data may need ([`crate::bytes::data_bytes`]). The
/// largest GPUs hold under 300 GB; 1 TiB leaves room for bigger ones and still refuses a typo.
pub const MAX_DEVICE_BYTES: u64 = 1 << 40;

impl Config {
    /// The graded configuration: one layer of a 70B-class model (`docs/task.md`, "The layer").
    pub fn graded() -> Self {
        Self {
            name: "graded".into(),
            layers: 1,
            d: 8192,
            ffn: 28672,
            n_q: 64,
            n_kv: 8,
            hd: 128,
            eps: 1e-5,
            theta: 500_000.0,
            batch: 1,
            prefill: 4096,
            max_seq_len: 4224,
            timed_steps: 32,
            correctness_steps: 8,
        }
    }

    /// A few-kilobyte layer for unit tests and CPU-only checks.
    pub fn tiny() -> Self {
        Self {
            name: "tiny".into(),
            d: 256,
            ffn: 768,
            n_q: 8,
            n_kv: 2,
            hd: 32,
            prefill: 64,
            max_seq_len: 128,
            timed_steps: 8,
            correctness_steps: 4,
            ..Self::graded()
        }
    }

    /// A layer a few times larger than `tiny`, with the graded head size and GQA ratio.
    pub fn small() -> Self {
        Self {
            name: "small".into(),
            d: 1024,
            ffn: 3584,
            n_q: 8,
            n_kv: 1,
            hd: 128,
            prefill: 512,
            max_seq_len: 640,
            timed_steps: 16,
            correctness_steps: 4,
            ..Self::graded()
        }
    }

    /// A named configuration (see [`CONFIG_NAMES`]).
    pub fn named(name: &str) -> Result<Self, SpecError> {
        match name {
            "graded" => Ok(Self::graded()),
            "small" => Ok(Self::small()),
            "tiny" => Ok(Self::tiny()),
            _ => Err(SpecError::UnknownConfig { name: name.into(), known: CONFIG_NAMES.join(", ") }),
        }
    }

    /// A configuration from JSON text (every field required, unknown fields refused), validated. A
    /// file may carry a built-in config's name only with that config's exact values, so a report's
    /// `config 'graded'` always means the graded layer.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, SpecError> {
        let bad = |reason: String| SpecError::BadConfigFile { path: origin.into(), reason };
        let cfg: Self = serde_json::from_str(text).map_err(|e| match Self::wrong_field(text) {
            Some((field, e)) => bad(format!("field '{field}': {e}")),
            None => bad(e.to_string()),
        })?;
        cfg.validate()?;
        if let Ok(builtin) = Self::named(&cfg.name)
            && builtin != cfg
        {
            return Err(bad(format!(
                "it is named '{}' like the built-in config but its values differ: give it a name of its own",
                cfg.name
            )));
        }
        Ok(cfg)
    }

    /// A field of `text` (a JSON object that did not parse as a config) whose value is of the wrong
    /// type, with serde's words for it: serde names only the line and column. Each of the file's
    /// values is tried alone in a config that parses; an unknown or missing field serde names itself.
    fn wrong_field(text: &str) -> Option<(String, serde_json::Error)> {
        let serde_json::Value::Object(fields) = serde_json::from_str(text).ok()? else { return None };
        let valid = serde_json::to_value(Self::tiny()).expect("a config serialises");
        fields.into_iter().find_map(|(field, value)| {
            let mut one = valid.clone();
            *one.get_mut(&field)? = value;
            serde_json::from_value::<Self>(one).err().map(|e| (field, e))
        })
    }

    /// A name from [`CONFIG_NAMES`], a member of the family or a named stack (`crate::family`), or
    /// the path of a JSON file, validated.
    pub fn load(name_or_path: &str) -> Result<Self, SpecError> {
        if CONFIG_NAMES.contains(&name_or_path) {
            return Self::named(name_or_path);
        }
        if let Some(member) = crate::family::find(name_or_path) {
            return Ok(member.config());
        }
        if let Some(stack) = crate::family::find_stack(name_or_path) {
            return Ok(stack.config());
        }
        if !std::path::Path::new(name_or_path).exists() {
            let family = crate::family::FAMILY.iter().map(|m| m.name).filter(|n| !CONFIG_NAMES.contains(n));
            let stacks = crate::family::STACKS.iter().map(|s| s.name);
            let known: Vec<&str> = CONFIG_NAMES.iter().copied().chain(family).chain(stacks).collect();
            return Err(SpecError::UnknownConfig { name: name_or_path.into(), known: known.join(", ") });
        }
        let text = std::fs::read_to_string(name_or_path)
            .map_err(|e| SpecError::BadConfigFile { path: name_or_path.into(), reason: e.to_string() })?;
        Self::from_json(&text, name_or_path)
    }

    /// Refuses a configuration that cannot work or that no device could hold, naming the field.
    pub fn validate(&self) -> Result<(), SpecError> {
        let bad = |field: &'static str, reason: String| Err(SpecError::InvalidConfig { field, reason });
        if self.name.trim().is_empty() {
            return bad("name", "must not be empty: reports name the config by it".into());
        }
        let sizes = [
            ("layers", self.layers),
            ("d", self.d),
            ("ffn", self.ffn),
            ("n_q", self.n_q),
            ("n_kv", self.n_kv),
            ("hd", self.hd),
            ("batch", self.batch),
            ("prefill", self.prefill),
            ("max_seq_len", self.max_seq_len),
            ("timed_steps", self.timed_steps),
            ("correctness_steps", self.correctness_steps),
        ];
        for (field, value) in sizes {
            if value == 0 {
                return bad(field, "must be at least 1".into());
            }
            if value > MAX_SIZE {
                return bad(field, format!("{value} is over {MAX_SIZE}, the largest size the C ABI's int32 carries"));
            }
        }
        if self.layers > MAX_LAYERS {
            return bad(
                "layers",
                format!("{} is over {MAX_LAYERS}, more than any model of the family has", self.layers),
            );
        }
        if self.batch != 1 {
            return bad("batch", format!("the task is batch 1, not {}", self.batch));
        }
        if !self.n_q.is_multiple_of(self.n_kv) {
            return bad("n_q", format!("{} query heads cannot be shared evenly by {} KV heads", self.n_q, self.n_kv));
        }
        if self.n_q.checked_mul(self.hd).is_none_or(|q_dim| q_dim > MAX_SIZE) {
            return bad("n_q", format!("n_q * hd is over {MAX_SIZE}, the widest row the kernels index"));
        }
        if !self.hd.is_multiple_of(2) {
            return bad("hd", format!("RoPE rotates pairs, so the head size must be even, not {}", self.hd));
        }
        // 8 bf16 = 16 bytes: every row must split into whole 16-byte vectors for vectorised kernels.
        for (field, value) in [("d", self.d), ("ffn", self.ffn), ("hd", self.hd)] {
            if value % 8 != 0 {
                return bad(field, format!("must be a multiple of 8 (16-byte rows), not {value}"));
            }
        }
        if !(self.eps > 0.0 && self.eps.is_finite()) {
            return bad("eps", format!("must be a positive finite number, not {}", self.eps));
        }
        if !(self.theta > 1.0 && self.theta.is_finite()) {
            return bad("theta", format!("must be a finite number above 1, not {}", self.theta));
        }
        // Every size is under 2^31 (above), so these sums cannot overflow a 64-bit usize.
        let needed = self.prefill + self.steps_per_phase_max();
        if needed > self.max_seq_len {
            return bad(
                "max_seq_len",
                format!(
                    "{} slots cannot hold {} prefilled positions plus {} steps",
                    self.max_seq_len,
                    self.prefill,
                    self.steps_per_phase_max()
                ),
            );
        }
        match crate::schedule::call_count(self).and_then(|calls| crate::bytes::data_bytes(self, calls)) {
            Some(bytes) if bytes <= MAX_DEVICE_BYTES => Ok(()),
            too_many => Err(SpecError::TooLarge { bytes: too_many, limit: MAX_DEVICE_BYTES }),
        }
    }

    /// Refuses a stack of more than one layer, for what works on one layer (`what`, said in the
    /// sentence): `grader launches`, `grader profile`, `grader run --dump`. `grader run` judges stacks.
    pub fn require_one_layer(&self, what: &str) -> Result<(), SpecError> {
        if self.layers == 1 {
            return Ok(());
        }
        Err(SpecError::InvalidConfig {
            field: "layers",
            reason: format!(
                "'{}' is a stack of {} layers; {what} works on one layer (`grader run` judges a stack, and \
                 `grader spec --config` describes it)",
                self.name, self.layers
            ),
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_q / self.n_kv
    }

    /// Width of the concatenated query heads (`n_q * hd`).
    pub fn q_dim(&self) -> usize {
        self.n_q * self.hd
    }

    /// Width of the concatenated key (or value) heads (`n_kv * hd`).
    pub fn kv_dim(&self) -> usize {
        self.n_kv * self.hd
    }

    /// Every phase of the run starts at `prefill`; the deepest position any phase reaches is
    /// `prefill + this - 1`.
    pub fn steps_per_phase_max(&self) -> usize {
        self.timed_steps.max(self.correctness_steps)
    }

    /// The deepest position a timed step attends from.
    pub fn deepest_timed_pos(&self) -> usize {
        self.prefill + self.timed_steps - 1
    }

    /// Elements of one cache tensor, K or V: `(batch, n_kv, max_seq_len, hd)`.
    pub fn cache_elems(&self) -> usize {
        self.batch * self.n_kv * self.max_seq_len * self.hd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(err: SpecError) -> &'static str {
        match err {
            SpecError::InvalidConfig { field, .. } => field,
            other => panic!("expected InvalidConfig, got {other}"),
        }
    }

    #[test]
    fn named_configs_are_valid() {
        for name in CONFIG_NAMES {
            Config::named(name).unwrap().validate().unwrap();
        }
    }

    #[test]
    fn graded_matches_the_task() {
        let c = Config::graded();
        assert_eq!((c.d, c.ffn, c.n_q, c.n_kv, c.hd), (8192, 28672, 64, 8, 128));
        assert_eq!((c.prefill, c.max_seq_len), (4096, 4224));
        assert_eq!((c.timed_steps, c.correctness_steps), (32, 8));
        assert_eq!(c.eps, 1e-5);
        assert_eq!(c.theta, 500_000.0);
        assert_eq!(c.deepest_timed_pos(), 4127);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let mut c = Config::tiny();
        c.n_q = 7;
        assert_eq!(field_of(c.validate().unwrap_err()), "n_q");
        let mut c = Config::tiny();
        c.hd = 33;
        assert_eq!(field_of(c.validate().unwrap_err()), "hd");
        let mut c = Config::tiny();
        c.max_seq_len = c.prefill + 2;
        assert_eq!(field_of(c.validate().unwrap_err()), "max_seq_len");
        let mut c = Config::tiny();
        c.batch = 2;
        assert_eq!(field_of(c.validate().unwrap_err()), "batch");
        let mut c = Config::tiny();
        c.d = 260;
        assert_eq!(field_of(c.validate().unwrap_err()), "d");
        let mut c = Config::tiny();
        c.eps = 0.0;
        assert_eq!(field_of(c.validate().unwrap_err()), "eps");
        let mut c = Config::tiny();
        c.timed_steps = 0;
        assert_eq!(field_of(c.validate().unwrap_err()), "timed_steps");
    }

    #[test]
    fn sizes_are_bounded_by_the_abi_and_the_device() {
        // d = 10^9 fits an int32 but its 5.9 TB of weights fit no device.
        let mut c = Config::tiny();
        c.d = 1_000_000_000;
        let msg = c.validate().unwrap_err().to_string();
        assert!(matches!(c.validate(), Err(SpecError::TooLarge { bytes: Some(b), .. }) if b > MAX_DEVICE_BYTES));
        assert!(msg.contains("TB") && msg.contains("use smaller sizes"), "{msg}");
        // Sizes past int32 are refused by field, before any arithmetic could wrap.
        for (field, set) in [
            ("d", (|c: &mut Config| c.d = 1_000_000_000_000) as fn(&mut Config)),
            ("ffn", |c| c.ffn = 1_000_000_000_000),
            ("max_seq_len", |c| c.max_seq_len = 1_000_000_000_000_000),
            ("timed_steps", |c| c.timed_steps = usize::MAX),
        ] {
            let mut c = Config::tiny();
            set(&mut c);
            assert_eq!(field_of(c.validate().unwrap_err()), field);
        }
        // Within int32 everywhere, but a product no 64-bit count holds: refused, not wrapped.
        let mut c = Config::tiny();
        (c.d, c.ffn, c.max_seq_len) = (MAX_SIZE / 8 * 8, MAX_SIZE / 8 * 8, MAX_SIZE);
        assert_eq!(crate::ByteModel::checked(&c, c.prefill), None);
        let msg = c.validate().unwrap_err().to_string();
        assert!(matches!(c.validate(), Err(SpecError::TooLarge { bytes: None, .. })), "{msg}");
        assert!(msg.contains("more than 2^64 bytes"), "{msg}");
    }

    #[test]
    fn a_file_may_not_borrow_a_builtin_name() {
        let mut c = Config::tiny();
        c.name = "graded".into();
        let msg = Config::from_json(&serde_json::to_string(&c).unwrap(), "x.json").unwrap_err().to_string();
        assert!(msg.contains("named 'graded'") && msg.contains("name of its own"), "{msg}");
        // The built-in config itself, as a file, loads as itself.
        let graded = serde_json::to_string(&Config::graded()).unwrap();
        assert_eq!(Config::from_json(&graded, "g.json").unwrap(), Config::graded());
        c.name = String::new();
        assert_eq!(field_of(Config::from_json(&serde_json::to_string(&c).unwrap(), "e.json").unwrap_err()), "name");
    }

    #[test]
    fn json_round_trip_and_refusals() {
        let c = Config::small();
        let text = serde_json::to_string(&c).unwrap();
        assert_eq!(Config::from_json(&text, "mem").unwrap(), c);
        let unknown = text.replacen("{", "{\"dd\":1,", 1);
        assert!(matches!(Config::from_json(&unknown, "mem"), Err(SpecError::BadConfigFile { .. })));
        let invalid = text.replace("\"n_kv\":1", "\"n_kv\":3");
        assert_eq!(field_of(Config::from_json(&invalid, "mem").unwrap_err()), "n_q");
    }

    #[test]
    fn a_value_of_the_wrong_type_is_named_by_its_field() {
        for (field, value) in [("d", "-256"), ("eps", "\"small\""), ("name", "3")] {
            let mut cfg = serde_json::to_value(Config::tiny()).unwrap();
            cfg[field] = serde_json::from_str(value).unwrap();
            let msg =
                Config::from_json(&serde_json::to_string_pretty(&cfg).unwrap(), "x.json").unwrap_err().to_string();
            assert!(msg.starts_with(&format!("config file x.json: field '{field}': invalid ")), "{msg}");
        }
        // Not an object, or not JSON: serde's own words.
        let msg = Config::from_json("[1]", "x.json").unwrap_err().to_string();
        assert!(!msg.contains("field '"), "{msg}");
    }

    #[test]
    fn unknown_name_lists_known_ones() {
        let msg = Config::load("huge").unwrap_err().to_string();
        assert!(msg.contains("graded") && msg.contains("tiny") && msg.contains("neither a file"), "{msg}");
    }
}
