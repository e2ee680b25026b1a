//! The bookkeeping of an audit that needs no GPU: the metric list, the ranges pushed so far, and
//! putting CUPTI's decoded ranges back in push order. Kept apart from the CUPTI calls so that
//! every rule is unit-tested.

use std::collections::HashSet;
use std::ffi::{CStr, CString, c_char};

use super::{AuditError, RangeValues};

/// The metrics an audit collects, in the caller's order, as CUPTI takes them: an array of C string
/// pointers that stays valid (and unchanged) as long as this lives.
pub(super) struct Metrics {
    names: Vec<CString>,
    /// Pointers into `names`' heap buffers, which do not move when `names` does.
    ptrs: Vec<*const c_char>,
}

impl Metrics {
    /// At least one name, no duplicate, no NUL.
    pub fn new(metrics: &[&str]) -> Result<Metrics, AuditError> {
        if metrics.is_empty() {
            return Err(AuditError::Misuse(
                "no metric to collect: name at least one (e.g. dram__bytes_read.sum)".into(),
            ));
        }
        let mut seen = HashSet::new();
        let names = metrics
            .iter()
            .map(|&m| {
                if !seen.insert(m) {
                    return Err(AuditError::Misuse(format!("metric {m} is listed twice: list each metric once")));
                }
                CString::new(m).map_err(|_| AuditError::Misuse(format!("metric name {m:?} contains a NUL byte")))
            })
            .collect::<Result<Vec<CString>, AuditError>>()?;
        let ptrs = names.iter().map(|n| n.as_ptr()).collect();
        Ok(Metrics { names, ptrs })
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.names.iter().map(|n| n.to_str().expect("made from &str")).collect()
    }

    /// The `const char**` CUPTI's params take. CUPTI only reads through it (every use is an `[in]`
    /// parameter), so handing out a mutable pointer to the shared array is sound.
    pub fn as_ptrs(&self) -> *mut *const c_char {
        self.ptrs.as_ptr().cast_mut()
    }
}

/// The ranges pushed so far: one level (no nesting), unique names, at most `max` of them. CUPTI
/// sums every range of the same name into one, so a repeated name would merge two calls' counts.
pub(super) struct RangeBook {
    max: usize,
    /// Every name pushed, in order; kept alive until the counter data is decoded.
    names: Vec<CString>,
    seen: HashSet<String>,
    open: bool,
}

impl RangeBook {
    pub fn new(max: usize) -> Result<RangeBook, AuditError> {
        if max == 0 {
            return Err(AuditError::Misuse("max_ranges is 0: allow at least one range".into()));
        }
        Ok(RangeBook { max, names: Vec::with_capacity(max), seen: HashSet::with_capacity(max), open: false })
    }

    /// Opens range `name` if the rules allow it and `cupti` accepts it.
    pub fn push(&mut self, name: &str, cupti: impl FnOnce(&CStr) -> Result<(), AuditError>) -> Result<(), AuditError> {
        if let Some(open) = self.open_name() {
            return Err(AuditError::Misuse(format!(
                "range {open:?} is still open: pop it before pushing {name:?} (ranges do not nest)"
            )));
        }
        if self.names.len() == self.max {
            return Err(AuditError::Misuse(format!(
                "range {name:?} would be range {} of at most {}: enable the audit with a larger max_ranges",
                self.max + 1,
                self.max
            )));
        }
        if self.seen.contains(name) {
            return Err(AuditError::Misuse(format!(
                "range name {name:?} was already used: give every range its own name (CUPTI merges ranges of the \
                 same name)"
            )));
        }
        let c = CString::new(name).map_err(|_| AuditError::Misuse(format!("range name {name:?} contains a NUL")))?;
        cupti(&c)?;
        self.seen.insert(name.to_string());
        self.names.push(c);
        self.open = true;
        Ok(())
    }

    /// Closes the open range if there is one and `cupti` accepts it.
    pub fn pop(&mut self, cupti: impl FnOnce() -> Result<(), AuditError>) -> Result<(), AuditError> {
        if !self.open {
            return Err(AuditError::Misuse("pop without an open range: push one first".into()));
        }
        cupti()?;
        self.open = false;
        Ok(())
    }

    /// The open range's name, if one is open.
    pub fn open_name(&self) -> Option<String> {
        self.open.then(|| self.names.last().map(|n| n.to_string_lossy().into_owned())).flatten()
    }

    /// The names pushed, in order.
    pub fn names(&self) -> Vec<String> {
        self.names.iter().map(|n| n.to_string_lossy().into_owned()).collect()
    }
}

/// The decoded ranges in push order, each pushed name exactly once; any other name, a missing or
/// repeated one, or a value that is not finite is an error.
pub(super) fn in_push_order(
    pushed: &[String],
    metrics: &[&str],
    mut decoded: Vec<RangeValues>,
) -> Result<Vec<RangeValues>, AuditError> {
    if decoded.len() != pushed.len() {
        let names: Vec<&str> = decoded.iter().map(|r| r.name.as_str()).collect();
        return Err(AuditError::Decoded(format!("{} ranges pushed, {} decoded: {names:?}", pushed.len(), names.len())));
    }
    let mut ordered = Vec::with_capacity(pushed.len());
    for name in pushed {
        let at = decoded.iter().position(|r| &r.name == name);
        let range = at
            .map(|i| decoded.swap_remove(i))
            .ok_or_else(|| AuditError::Decoded(format!("range {name:?} is missing from the decoded ranges")))?;
        if let Some((metric, value)) = metrics.iter().zip(&range.values).find(|(_, v)| !v.is_finite()) {
            return Err(AuditError::Decoded(format!("{metric} of range {name:?} evaluated to {value}")));
        }
        ordered.push(range);
    }
    Ok(ordered)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn misuse(e: AuditError) -> String {
        match e {
            AuditError::Misuse(why) => why,
            other => panic!("expected a misuse, got {other:?}"),
        }
    }

    #[test]
    fn metric_lists_are_checked() {
        let metrics = Metrics::new(&["dram__bytes_read.sum", "sm__ctas_launched.sum"]).unwrap();
        assert_eq!((metrics.len(), metrics.names()), (2, vec!["dram__bytes_read.sum", "sm__ctas_launched.sum"]));
        // SAFETY: `as_ptrs` points to `len` pointers to live NUL-terminated strings.
        let second = unsafe { CStr::from_ptr(*metrics.as_ptrs().add(1)) };
        assert_eq!(second, c"sm__ctas_launched.sum");
        let error = |names: &[&str]| misuse(Metrics::new(names).err().expect("refused"));
        assert!(error(&[]).starts_with("no metric to collect"));
        assert_eq!(error(&["a.sum", "b.sum", "a.sum"]), "metric a.sum is listed twice: list each metric once");
        assert!(error(&["a\0b"]).contains("NUL"));
    }

    #[test]
    fn ranges_open_and_close_in_turn() {
        let mut book = RangeBook::new(3).unwrap();
        let mut calls = Vec::new();
        book.push("build", |c| {
            calls.push(c.to_owned());
            Ok(())
        })
        .unwrap();
        assert_eq!(book.open_name().as_deref(), Some("build"));
        let nested = misuse(book.push("call 0", |_| unreachable!("rejected before CUPTI")).unwrap_err());
        assert_eq!(nested, "range \"build\" is still open: pop it before pushing \"call 0\" (ranges do not nest)");
        book.pop(|| Ok(())).unwrap();
        assert_eq!(book.open_name(), None);
        assert!(misuse(book.pop(|| unreachable!()).unwrap_err()).starts_with("pop without an open range"));
        book.push("call 0", |c| {
            calls.push(c.to_owned());
            Ok(())
        })
        .unwrap();
        book.pop(|| Ok(())).unwrap();
        assert_eq!(calls, [c"build".to_owned(), c"call 0".to_owned()]);
        assert_eq!(book.names(), ["build", "call 0"]);
    }

    #[test]
    fn names_are_unique_and_bounded() {
        let mut book = RangeBook::new(2).unwrap();
        book.push("call 0", |_| Ok(())).unwrap();
        book.pop(|| Ok(())).unwrap();
        let again = misuse(book.push("call 0", |_| unreachable!()).unwrap_err());
        assert!(again.starts_with("range name \"call 0\" was already used"), "{again}");
        book.push("call 1", |_| Ok(())).unwrap();
        book.pop(|| Ok(())).unwrap();
        let full = misuse(book.push("call 2", |_| unreachable!()).unwrap_err());
        assert_eq!(full, "range \"call 2\" would be range 3 of at most 2: enable the audit with a larger max_ranges");
        assert!(misuse(RangeBook::new(0).err().unwrap()).starts_with("max_ranges is 0"));
        assert!(misuse(RangeBook::new(1).unwrap().push("a\0", |_| unreachable!()).unwrap_err()).contains("NUL"));
    }

    #[test]
    fn a_refused_push_or_pop_changes_nothing() {
        let mut book = RangeBook::new(2).unwrap();
        let refused = || Err(AuditError::Misuse("refused".into()));
        assert!(book.push("call 0", |_| refused()).is_err());
        assert_eq!((book.open_name(), book.names().len()), (None, 0));
        book.push("call 0", |_| Ok(())).unwrap();
        assert!(book.pop(refused).is_err());
        assert_eq!(book.open_name().as_deref(), Some("call 0"));
    }

    fn range(name: &str, values: &[f64]) -> RangeValues {
        RangeValues { name: name.into(), values: values.to_vec() }
    }

    const METRICS: [&str; 2] = ["dram__bytes_read.sum", "sm__ctas_launched.sum"];

    #[test]
    fn decoded_ranges_come_back_in_push_order() {
        let pushed = ["build".to_string(), "call 0".into(), "call 1".into()];
        let decoded = vec![range("call 1", &[3.0, 30.0]), range("build", &[1.0, 10.0]), range("call 0", &[2.0, 20.0])];
        let ordered = in_push_order(&pushed, &METRICS, decoded).unwrap();
        let expected = [range("build", &[1.0, 10.0]), range("call 0", &[2.0, 20.0]), range("call 1", &[3.0, 30.0])];
        assert_eq!(ordered, expected);
    }

    fn decoded_error(pushed: &[&str], decoded: Vec<RangeValues>) -> String {
        let pushed: Vec<String> = pushed.iter().map(|s| s.to_string()).collect();
        match in_push_order(&pushed, &METRICS, decoded).unwrap_err() {
            AuditError::Decoded(why) => why,
            other => panic!("expected a decoding error, got {other:?}"),
        }
    }

    #[test]
    fn missing_extra_and_repeated_ranges_are_errors() {
        let short = decoded_error(&["a", "b"], vec![range("a", &[1.0, 1.0])]);
        assert_eq!(short, "2 ranges pushed, 1 decoded: [\"a\"]");
        let renamed = decoded_error(&["a", "b"], vec![range("a", &[1.0, 1.0]), range("c", &[1.0, 1.0])]);
        assert_eq!(renamed, "range \"b\" is missing from the decoded ranges");
        let repeated = decoded_error(&["a", "b"], vec![range("a", &[1.0, 1.0]), range("a", &[2.0, 2.0])]);
        assert_eq!(repeated, "range \"b\" is missing from the decoded ranges");
        let nan = decoded_error(&["a"], vec![range("a", &[1.0, f64::NAN])]);
        assert_eq!(nan, "sm__ctas_launched.sum of range \"a\" evaluated to NaN");
    }
}
