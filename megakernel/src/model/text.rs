//! A checkpoint's tokenizer (`tokenizer.json`, read by the `tokenizers` crate): the prompt to tokens
//! with the model's special tokens added as its post-processor says (a leading `<s>` or
//! `<|begin_of_text|>`), and tokens back to text without them.

use std::path::{Path, PathBuf};

use tokenizers::Tokenizer;

use super::hf::ModelError;

pub struct Text {
    tokenizer: Tokenizer,
    path: PathBuf,
}

impl Text {
    /// Reads `dir/tokenizer.json`.
    pub fn read(dir: &Path) -> Result<Text, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::Io {
                path,
                why: "not found: text in and out needs the checkpoint's tokenizer (tokens do not)".into(),
            });
        }
        let tokenizer =
            Tokenizer::from_file(&path).map_err(|e| ModelError::Io { path: path.clone(), why: e.to_string() })?;
        Ok(Text { tokenizer, path })
    }

    /// A tokenizer from the text of a `tokenizer.json` (a loaded tokenizer's, serialised); `origin` is
    /// what an error names.
    pub fn parse(origin: &Path, json: &str) -> Result<Text, ModelError> {
        let path = origin.to_path_buf();
        let tokenizer =
            json.parse::<Tokenizer>().map_err(|e| ModelError::Io { path: path.clone(), why: e.to_string() })?;
        Ok(Text { tokenizer, path })
    }

    /// The tokens of `text`, the model's special tokens added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let encoding = self.tokenizer.encode(text, true).map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `tokens`, special tokens left out.
    pub fn decode(&self, tokens: &[u32]) -> Result<String, ModelError> {
        self.tokenizer.decode(tokens, true).map_err(|e| self.error(e))
    }

    fn error(&self, e: tokenizers::Error) -> ModelError {
        ModelError::Io { path: self.path.clone(), why: e.to_string() }
    }
}
