//! The compiled kernels of every build script run, kept under the target folder by what decides
//! their bytes, so that a build script that runs again with the same inputs copies instead of
//! compiling. Cargo runs a build script again whenever the script itself is built anew: for
//! `cargo clippy` (whose wrapper builds every workspace member's script again), another profile, or
//! a feature of its package; the megakernel's kernels alone take minutes on a 2-core machine.
//!
//! An entry is `<target>/kernel-cache/<owner>-<stem>-<key>.{fatbin,ptxas.txt}`; storing one removes
//! the older entries of the same file, so the cache holds one version of each. Entries are written
//! to a temporary name and renamed, so a build that stops midway leaves none half written. Nothing
//! is trusted but the key: a lost or unreadable entry is compiled again.

use std::hash::{DefaultHasher, Hasher};
use std::path::{Path, PathBuf};

/// The cache folder's name under the target folder.
const FOLDER: &str = "kernel-cache";

/// 128 bits over every input of a compilation, in order: two SipHash streams told apart by their
/// first byte (`DefaultHasher::new` has fixed keys, so the same inputs give the same key in every
/// build script run of one toolchain).
pub struct Key([DefaultHasher; 2]);

impl Key {
    pub fn new() -> Key {
        let mut hashers = [DefaultHasher::new(), DefaultHasher::new()];
        for (i, h) in hashers.iter_mut().enumerate() {
            h.write_u8(i as u8);
        }
        Key(hashers)
    }

    /// Adds one input, its length first, so that two inputs cannot run into each other.
    pub fn add(&mut self, bytes: &[u8]) {
        for h in &mut self.0 {
            h.write_usize(bytes.len());
            h.write(bytes);
        }
    }

    fn hex(&self) -> String {
        format!("{:016x}{:016x}", self.0[0].finish(), self.0[1].finish())
    }
}

/// The cache folder of one target folder.
pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    /// The cache of the target folder that `out_dir` (a build script's `OUT_DIR`,
    /// `<target>/<profile>/build/<package>-<hash>/out`) lies in; `None` for any other layout, when
    /// every file is compiled.
    pub fn beside(out_dir: &Path) -> Option<Cache> {
        let build = out_dir.ancestors().nth(2)?;
        if build.file_name()? != "build" {
            return None;
        }
        let dir = build.parent()?.parent()?.join(FOLDER);
        std::fs::create_dir_all(&dir).ok()?;
        Some(Cache { dir })
    }

    /// The entry of file `name` (`<owner>-<stem>`) compiled from the inputs of `key`.
    pub fn entry(&self, name: &str, key: &Key) -> Entry {
        Entry { dir: self.dir.clone(), prefix: format!("{name}-"), stem: format!("{name}-{}", key.hex()) }
    }
}

/// One compiled file in the cache.
pub struct Entry {
    dir: PathBuf,
    /// What every version of this file's entries starts with.
    prefix: String,
    /// This version's name, without extension.
    stem: String,
}

impl Entry {
    fn paths(&self) -> (PathBuf, PathBuf) {
        (self.dir.join(format!("{}.fatbin", self.stem)), self.dir.join(format!("{}.ptxas.txt", self.stem)))
    }

    /// Copies the entry to `fatbin` and `report`; false when it is not there.
    pub fn restore(&self, fatbin: &Path, report: &Path) -> bool {
        let (f, r) = self.paths();
        f.is_file() && r.is_file() && std::fs::copy(&f, fatbin).is_ok() && std::fs::copy(&r, report).is_ok()
    }

    /// Keeps `fatbin` and `report` as this entry and drops the file's other versions. Best effort: a
    /// cache that cannot be written only costs the next run a compilation.
    pub fn store(&self, fatbin: &Path, report: &Path) {
        let (f, r) = self.paths();
        for (from, to) in [(report, &r), (fatbin, &f)] {
            let tmp = to.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::copy(from, &tmp).is_err() || std::fs::rename(&tmp, to).is_err() {
                let _ = std::fs::remove_file(&tmp);
                return;
            }
        }
        let ours = [f.file_name().unwrap().to_owned(), r.file_name().unwrap().to_owned()];
        for old in std::fs::read_dir(&self.dir).into_iter().flatten().filter_map(|e| e.ok()) {
            let name = old.file_name();
            if !ours.contains(&name) && is_entry(&name.to_string_lossy(), &self.prefix) {
                let _ = std::fs::remove_file(old.path());
            }
        }
    }
}

/// Whether `name` is an entry of the file whose entries start with `prefix`: the prefix, then 32
/// hex digits and an extension (so `grader-verify-` never matches `grader-verify-more-<key>`).
fn is_entry(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|rest| rest.split_once('.'))
        .is_some_and(|(hex, _)| hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_inputs_apart_and_repeat() {
        let of = |parts: &[&[u8]]| {
            let mut k = Key::new();
            for p in parts {
                k.add(p);
            }
            k.hex()
        };
        assert_eq!(of(&[b"ab", b"c"]), of(&[b"ab", b"c"]));
        assert_ne!(of(&[b"ab", b"c"]), of(&[b"a", b"bc"]), "inputs are delimited");
        assert_ne!(of(&[b"x"]), of(&[b"y"]));
        assert_eq!(of(&[]).len(), 32);
    }

    #[test]
    fn an_entry_is_restored_and_replaces_its_older_versions_only() {
        let root = std::env::temp_dir().join(format!("cuda-build-cache-{}", std::process::id()));
        let out = root.join("target/release/build/pkg-0123/out");
        std::fs::create_dir_all(&out).unwrap();
        let cache = Cache::beside(&out).expect("a target layout");
        assert!(cache.dir.ends_with("target/kernel-cache"));
        assert!(Cache::beside(&root.join("elsewhere/out")).is_none());
        let (fatbin, report) = (out.join("a.fatbin"), out.join("a.txt"));
        let mut key = Key::new();
        key.add(b"one");
        let first = cache.entry("grader-verify", &key);
        assert!(!first.restore(&fatbin, &report), "nothing stored yet");
        std::fs::write(&fatbin, b"fat1").unwrap();
        std::fs::write(&report, b"rep1").unwrap();
        first.store(&fatbin, &report);
        // Another file whose name starts alike: `grader-verify-more.cu`.
        let other = cache.dir.join(format!("grader-verify-more-{}.fatbin", "0".repeat(32)));
        std::fs::write(&other, b"other file").unwrap();
        key.add(b"two");
        let second = cache.entry("grader-verify", &key);
        second.store(&fatbin, &report);
        assert!(!first.restore(&fatbin, &report), "the older version is gone");
        assert!(other.is_file(), "another file's entry stays");
        std::fs::write(&fatbin, b"changed").unwrap();
        assert!(second.restore(&fatbin, &report));
        assert_eq!(std::fs::read(&fatbin).unwrap(), b"fat1");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
