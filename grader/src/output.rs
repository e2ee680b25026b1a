//! Where a command's files go: a path, or stdout for `-`.

use std::io::Write;
use std::path::Path;

use crate::error::GraderError;

/// Writes `text` to `path`, or to stdout when the path is `-`.
pub fn write_output(path: &Path, text: &str) -> Result<(), GraderError> {
    let err = |source| GraderError::Write { path: path.display().to_string(), source };
    if path == Path::new("-") {
        std::io::stdout().write_all(text.as_bytes()).map_err(err)
    } else {
        std::fs::write(path, text).map_err(err)
    }
}
