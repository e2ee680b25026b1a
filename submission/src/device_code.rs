//! Finds device-side kernel launches (CUDA dynamic parallelism) in device code, so that the grader
//! can refuse them: on Hopper, CUPTI's activity records count only the kernels the host launches, and
//! a one-thread parent that launches twenty children from the device is counted as one kernel.
//!
//! **What a module that launches from the device looks like** (nvcc 13.0, read from compiled examples):
//! `child<<<grid, block, smem, stream>>>(args)` in device code compiles only with relocatable device
//! code (`-rdc=true`), to two calls of the device runtime: `__cudaCDP2GetParameterBufferV2` and
//! `__cudaCDP2LaunchDeviceV2` (external functions in PTX, undefined symbols in the relocatable cubin).
//! The device link with `libcudadevrt.a` brings their code in, and that code imports the driver's
//! device-side routines: the linked cubin has the undefined symbols `__cuda_syscall_cnpv2LaunchDeviceV2`
//! and `__cuda_syscall_cnpv2GetParameterBufferV2`, named in the wrappers' `EIATTR_EXTERNS` attribute
//! (the functions the driver must bind for them) and relocated at the call sites. Device-side
//! `cudaGraphLaunch` compiles, even without `-rdc`, to an undefined `cudaGraphLaunch`; tail launches
//! and fire-and-forget launches are stream handles passed to the same calls; device-side
//! `cudaMemcpyAsync`/`cudaMemsetAsync` launch the runtime's own kernels through them.
//!
//! **What is detected, and why it cannot be removed cheaply.** Any symbol (cubin) or identifier (PTX)
//! that names one of those entry points ([`is_launch_entry_point`]): the driver's imports
//! (`__cuda_syscall_cnpv2*`, `__cuda_syscall_cnp*`), the device runtime's (`__cudaCDP2*`, `cnp*`) and
//! the public names (`cudaLaunchDeviceV2`, `cudaGetParameterBuffer`, `cudaGraphLaunch`, ...), with
//! the `_ptsz` variants. The decisive ones are the imports of a linked cubin: the launch itself is the
//! driver's code, which a module reaches only through symbols the driver binds *by name* when it loads
//! the module, as a dynamic linker does. Renaming or stripping such a symbol leaves the call unbound,
//! and the module fails to load or calls nowhere. The runtime's wrappers are the module's own code and
//! could be renamed, which is why the imports they make are reported too; before the device link
//! (PTX, relocatable cubins) the wrapper names are the imports.
//!
//! **Where it looks.** [`scan`] reads one module image as the driver receives it: a cubin, a fatbin
//! (every entry, inflating zstd and LZ4 ones) or PTX text. [`scan_library`] reads a host binary before
//! it is loaded: every fatbin in it (`.nv_fatbin` for linked code, `__nv_relfatbin` for relocatable
//! code, any other place for fatbins embedded by hand) and, outside them, any device-only name
//! (`__cuda_syscall_*`, `__cudaCDP2*`) in the raw bytes, which PTX or a cubin kept as plain data carry.
//! A module the scanner cannot read (an unknown compression, a malformed container) is a finding too:
//! it is not inspected, so it cannot be vouched for.
//!
//! **What it cannot see.** Machine code written by hand that branches to the driver's launch routine
//! by an address found at run time carries no import (no toolchain emits that; the busy-time and
//! kernel-count gates remain). Device code that a library decompresses or decrypts itself and loads
//! at run time is invisible to [`scan_library`], but not to [`scan`] on the module the driver
//! receives. LTO-IR entries are skipped: their payload is in no documented form (nvcc 13.0's is
//! neither plain nor a zstd frame), and the driver cannot load them as they are, only the cubin a JIT
//! link makes of them, which [`scan`] reads when it is loaded.
//!
//! **Not evidence:** grid-wide synchronisation (cooperative groups compile to inline code; the device
//! runtime's `cudaCGSynchronizeGrid`/`cudaCGGetIntrinsicHandle` are synchronisation too), `printf`,
//! `malloc`, `free` and `assert` (the driver binds `vprintf`, `malloc`, `free`, `__assertfail` by name
//! too, but they launch nothing), programmatic dependent launch (instructions, no call).

mod elf;
mod fatbin;

use std::fmt;

pub use fatbin::Compression;

/// The device runtime's entry points that start work from the device, spelled without prefix:
/// kernel launches (the parameter buffer comes first), graph launches, and the copies and sets that
/// the runtime carries out by launching kernels of its own.
const LAUNCH_ENTRY_POINTS: &[&str] = &[
    "LaunchDeviceV2",
    "LaunchDevice",
    "GetParameterBufferV2",
    "GetParameterBuffer",
    "GraphLaunch",
    "MemcpyAsync",
    "Memcpy2DAsync",
    "Memcpy3DAsync",
    "MemsetAsync",
    "Memset2DAsync",
    "Memset3DAsync",
];

/// How the toolchain prefixes them: the driver's imports (CDP2, then CDP1), the device runtime's
/// wrappers (CDP2, then CDP1's imports), the public API.
const PREFIXES: &[&str] = &["__cuda_syscall_cnpv2", "__cuda_syscall_cnp", "__cudaCDP2", "cnp", "cuda"];

/// Prefixes that only device code uses: host code (the CUDA runtime linked into a library) carries
/// the public names (`cudaMemcpyAsync`, `cudaGraphLaunch`) as host functions, never these.
const DEVICE_ONLY_PREFIXES: &[&str] = &["__cuda_syscall_", "__cudaCDP2"];

/// Suffix of the per-thread-default-stream variant of an entry point.
const PER_THREAD_STREAM: &str = "_ptsz";

/// Whether `name` is an entry point of the device runtime that launches work from the device.
pub fn is_launch_entry_point(name: &str) -> bool {
    let name = name.strip_suffix(PER_THREAD_STREAM).unwrap_or(name);
    PREFIXES.iter().any(|p| name.strip_prefix(p).is_some_and(|rest| LAUNCH_ENTRY_POINTS.contains(&rest)))
}

/// What a module holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Fatbin,
    Cubin,
    Ptx,
    /// A fatbin entry of a kind this scanner does not parse (searched for the names as raw text).
    Other(u16),
    /// Bytes that are neither a fatbin, a cubin nor PTX text.
    Unrecognised,
}

/// One module within the scanned bytes: where it is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Where it is, outermost first ("section .nv_fatbin", "fatbin at 0x40", "entry 2 of 3"); empty
    /// for the image [`scan`] was given.
    pub location: Vec<String>,
    /// What it holds; `None` for raw bytes of a host file outside any fatbin.
    pub kind: Option<Kind>,
    /// The SM version of a fatbin entry (90 for sm_90a).
    pub arch: Option<u32>,
    /// Bytes as stored (compressed, for a compressed entry).
    pub bytes: usize,
    pub compression: Option<Compression>,
}

/// How a module uses a launch entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Usage {
    /// An undefined symbol of a cubin: the driver (or the device link) must bind it by name.
    Imports,
    /// A function the cubin defines: the device runtime's wrapper, linked in.
    Defines,
    /// PTX text that names it, on this line (a declaration or a call).
    Names { line: usize },
    /// Raw bytes that contain the name, at this offset of the module.
    Contains { offset: usize },
}

/// What was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// The module uses an entry point that launches from the device; `callers` are the functions
    /// whose code refers to it (cubins only).
    Launch { symbol: String, usage: Usage, callers: Vec<String> },
    /// The scanner could not read the module, so it cannot vouch for it.
    Uninspected { why: String },
}

/// One piece of evidence in one module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub module: Module,
    pub evidence: Evidence,
}

impl Finding {
    /// Whether this is a device-side launch (rather than a module that could not be inspected).
    pub fn is_launch(&self) -> bool {
        matches!(self.evidence, Evidence::Launch { .. })
    }
}

/// One sentence for a verdict: how many findings, and the most telling one (a driver import before a
/// definition, a name, raw bytes, a module not inspected; the first of equals). `None`: no finding.
pub fn summary(findings: &[Finding]) -> Option<String> {
    let rank = |f: &&Finding| match &f.evidence {
        Evidence::Launch { usage, .. } => Some(*usage),
        Evidence::Uninspected { .. } => None,
    };
    // Modules not inspected (no usage) rank last.
    let first = findings.iter().min_by_key(|f| (rank(f).is_none(), rank(f)))?;
    Some(match findings.len() {
        1 => format!("1 finding: {first}"),
        n => format!("{n} findings, the most telling: {first}"),
    })
}

/// Callers named in a finding before the rest are counted.
const CALLERS_SHOWN: usize = 3;

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.evidence {
            Evidence::Launch { symbol, usage, callers } => {
                let verb = match usage {
                    Usage::Imports => "imports".to_string(),
                    Usage::Defines => "defines".to_string(),
                    Usage::Names { line } => format!("names (line {line})"),
                    Usage::Contains { offset } => format!("contains (at byte {offset:#x}) the name"),
                };
                write!(f, "{} {verb} {symbol}", self.module)?;
                if let Some((first, rest)) = callers.split_first() {
                    write!(f, " (called by {first}")?;
                    for c in rest.iter().take(CALLERS_SHOWN - 1) {
                        write!(f, ", {c}")?;
                    }
                    if callers.len() > CALLERS_SHOWN {
                        write!(f, " and {} more", callers.len() - CALLERS_SHOWN)?;
                    }
                    write!(f, ")")?;
                }
                write!(
                    f,
                    ": device-side launch (CUDA dynamic parallelism), which no kernel count sees; launch every \
                     kernel from the host"
                )
            }
            Evidence::Uninspected { why } => write!(f, "{}: not inspected, {why}", self.module),
        }
    }
}

impl fmt::Display for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let location = self.location.join(", ");
        let Some(kind) = self.kind else {
            return write!(f, "{location}");
        };
        if !location.is_empty() {
            write!(f, "{location}: ")?;
        }
        match (kind, self.arch) {
            (Kind::Fatbin, _) => write!(f, "fatbin")?,
            (Kind::Cubin, Some(arch)) => write!(f, "cubin sm_{arch}")?,
            (Kind::Cubin, None) => write!(f, "cubin")?,
            (Kind::Ptx, Some(arch)) => write!(f, "PTX compute_{arch}")?,
            (Kind::Ptx, None) => write!(f, "PTX")?,
            (Kind::Other(k), _) => write!(f, "fatbin entry of kind {k}")?,
            (Kind::Unrecognised, _) => write!(f, "unrecognised bytes")?,
        }
        write!(f, " ({}", Size(self.bytes))?;
        match self.compression {
            Some(Compression::Zstd) => write!(f, ", zstd)"),
            Some(Compression::Lz4) => write!(f, ", LZ4)"),
            None => write!(f, ")"),
        }
    }
}

/// A byte count as people read it.
struct Size(usize);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const KIB: usize = 1 << 10;
        const MIB: usize = 1 << 20;
        match self.0 {
            n if n < KIB => write!(f, "{n} bytes"),
            n if n < MIB => write!(f, "{} KB", n.div_ceil(KIB)),
            n => write!(f, "{:.1} MB", n as f64 / MIB as f64),
        }
    }
}

/// The findings in one module image as the driver receives it (what CUPTI's module-loaded callback
/// hands over, or what a library passes to `cuModuleLoadData`): a cubin, a fatbin or PTX text. Within
/// each module, the strongest evidence comes first (imports, then definitions, then names), so a
/// verdict can quote the first finding and count the rest. Empty: no device-side launch.
pub fn scan(image: &[u8]) -> Vec<Finding> {
    let mut findings = Vec::new();
    let here = Module { location: Vec::new(), kind: None, arch: None, bytes: image.len(), compression: None };
    if fatbin::starts_with_magic(image) {
        scan_fatbin(image, &here.location, &mut findings);
    } else if image.starts_with(elf::MAGIC) {
        scan_cubin(image, Module { kind: Some(Kind::Cubin), ..here }, &mut findings);
    } else if looks_like_ptx(image) {
        scan_text(image, Module { kind: Some(Kind::Ptx), ..here }, &mut findings);
    } else {
        findings.push(Finding {
            module: Module { kind: Some(Kind::Unrecognised), ..here },
            evidence: Evidence::Uninspected {
                why: "neither a fatbin, a cubin nor PTX text: no module format the driver loads".into(),
            },
        });
    }
    findings
}

/// The findings in a host binary (a submission's shared library), read before it is loaded: every
/// fatbin it carries, and device-only names in the bytes outside them. Locations name the section.
pub fn scan_library(file: &[u8]) -> Vec<Finding> {
    let sections: Vec<(String, std::ops::Range<usize>)> = elf::Elf::parse(file)
        .map(|e| e.sections().filter_map(|(name, s)| Some((name.to_string(), e.file_range(&s)?))).collect())
        .unwrap_or_default();
    // The innermost section holding `offset`, if any.
    let section = |offset: usize| {
        sections.iter().filter(|(_, r)| r.contains(&offset)).min_by_key(|(_, r)| r.len()).map(|(name, _)| name.as_str())
    };
    let mut findings = Vec::new();
    let mut outside = 0;
    let mut at = 0;
    while let Some(found) = find(file, &fatbin::MAGIC.to_le_bytes(), at) {
        // A magic number alone can occur anywhere (code that parses fatbins compares with it); a
        // valid header that fits in the file marks a fatbin.
        let place = section(found);
        let location = || {
            let place = place.map_or_else(|| "outside any section".to_string(), |s| format!("section {s}"));
            vec![place, format!("fatbin at {found:#x}")]
        };
        let len = match fatbin::container_len(&file[found..]) {
            Ok(len) => len,
            Err(why) => {
                // Where the toolchain puts fatbins, one that cannot be read is not passed over.
                if place.is_some_and(|p| FATBIN_SECTIONS.contains(&p)) {
                    findings.push(malformed_fatbin(location(), file.len() - found, why));
                }
                at = found + 1;
                continue;
            }
        };
        scan_raw(file, outside..found, &section, &mut findings);
        scan_fatbin(&file[found..found + len], &location(), &mut findings);
        at = found + len;
        outside = at;
    }
    scan_raw(file, outside..file.len(), &section, &mut findings);
    findings
}

/// The sections of a host binary where the toolchain puts fatbins: linked code, relocatable code.
const FATBIN_SECTIONS: &[&str] = &[".nv_fatbin", "__nv_relfatbin"];

/// A fatbin that could not be read.
fn malformed_fatbin(location: Vec<String>, bytes: usize, why: String) -> Finding {
    let module = Module { location, kind: Some(Kind::Fatbin), arch: None, bytes, compression: None };
    Finding { module, evidence: Evidence::Uninspected { why: malformed(&why) } }
}

/// The reason a malformed module was not inspected, with what to do about it.
fn malformed(why: &str) -> String {
    format!("malformed ({why}); rebuild it with nvcc 13.0")
}

/// Every entry of the fatbin `data`, at `location`.
fn scan_fatbin(data: &[u8], location: &[String], findings: &mut Vec<Finding>) {
    let parsed = match fatbin::parse(data) {
        Ok(parsed) => parsed,
        Err(why) => return findings.push(malformed_fatbin(location.to_vec(), data.len(), why)),
    };
    let count = parsed.entries.len();
    for (i, e) in parsed.entries.iter().enumerate() {
        let mut place = location.to_vec();
        let entry = if location.is_empty() { "fatbin entry" } else { "entry" };
        place.push(format!("{entry} {} of {count}", i + 1));
        let kind = match e.payload {
            fatbin::Payload::Cubin => Kind::Cubin,
            fatbin::Payload::Ptx => Kind::Ptx,
            // In no documented form, and never loaded as it is: see the module's header.
            fatbin::Payload::LtoIr => continue,
            fatbin::Payload::Other(k) => Kind::Other(k),
        };
        let module = Module {
            location: place,
            kind: Some(kind),
            arch: Some(e.arch),
            bytes: e.stored.len(),
            compression: e.compression().ok().flatten(),
        };
        match e.contents() {
            Ok(contents) if kind == Kind::Cubin => scan_cubin(&contents, module, findings),
            Ok(contents) => scan_text(&contents, module, findings),
            Err(why) => findings.push(Finding { module, evidence: Evidence::Uninspected { why: uninflated(&why) } }),
        }
    }
    if let Some(why) = parsed.truncated {
        findings.push(malformed_fatbin(location.to_vec(), data.len(), format!("after entry {count}, {why}")));
    }
}

/// The reason a fatbin entry could not be inflated, with what to do about it.
fn uninflated(why: &str) -> String {
    format!("{why}; rebuild with nvcc 13.0's default compression or with -Xfatbin -compress-mode=none")
}

/// The symbols of a cubin that name launch entry points, strongest evidence first.
fn scan_cubin(data: &[u8], module: Module, findings: &mut Vec<Finding>) {
    let mut found = match elf::Elf::parse(data).map_err(|why| malformed(&why)).and_then(|elf| cubin_launches(&elf)) {
        Ok(found) => found,
        Err(why) => return findings.push(Finding { module, evidence: Evidence::Uninspected { why } }),
    };
    found.sort_by_key(|(_, usage, _)| *usage);
    findings.extend(found.into_iter().map(|(symbol, usage, callers)| Finding {
        module: module.clone(),
        evidence: Evidence::Launch { symbol, usage, callers },
    }));
}

/// `(symbol, usage, callers)` for each launch entry point a cubin's symbol tables name.
fn cubin_launches(elf: &elf::Elf<'_>) -> Result<Vec<(String, Usage, Vec<String>)>, String> {
    if elf.machine() != elf::EM_CUDA {
        return Err(format!(
            "an ELF file for machine {}, not GPU code (machine {}): no module the driver loads",
            elf.machine(),
            elf::EM_CUDA
        ));
    }
    let mut found = Vec::new();
    for table in elf.symbol_tables() {
        let symbols = elf.symbols(table).map_err(|why| malformed(&why))?;
        let references = elf.code_references(table, &symbols).map_err(|why| malformed(&why))?;
        for (index, sym) in symbols.iter().enumerate().filter(|(_, s)| is_launch_entry_point(s.name)) {
            let mut callers: Vec<String> = references
                .iter()
                .filter(|(target, caller)| *target == index && *caller != sym.name)
                .map(|(_, caller)| caller.to_string())
                .collect();
            callers.sort();
            callers.dedup();
            let usage = if sym.section == elf::SHN_UNDEF { Usage::Imports } else { Usage::Defines };
            found.push((sym.name.to_string(), usage, callers));
        }
    }
    Ok(found)
}

/// Whether `data` reads as PTX: text that declares its ISA version and target, as every PTX module must.
fn looks_like_ptx(data: &[u8]) -> bool {
    let text = until_nul(data);
    find(text, b".version", 0).is_some() && find(text, b".target", 0).is_some()
}

/// The bytes before the first NUL: PTX in a fatbin is padded with them.
fn until_nul(data: &[u8]) -> &[u8] {
    data.iter().position(|&b| b == 0).map_or(data, |end| &data[..end])
}

/// The launch entry points that PTX text (or an entry of an unknown kind, read as text) names, each
/// once, where it first appears.
fn scan_text(data: &[u8], module: Module, findings: &mut Vec<Finding>) {
    let is_ptx = module.kind == Some(Kind::Ptx);
    let text = if is_ptx { until_nul(data) } else { data };
    let mut seen: Vec<&str> = Vec::new();
    for (offset, name) in identifiers(text).filter(|(_, name)| is_launch_entry_point(name)) {
        if seen.contains(&name) {
            continue;
        }
        seen.push(name);
        let usage = if is_ptx {
            Usage::Names { line: 1 + text[..offset].iter().filter(|&&b| b == b'\n').count() }
        } else {
            Usage::Contains { offset }
        };
        let evidence = Evidence::Launch { symbol: name.to_string(), usage, callers: Vec::new() };
        findings.push(Finding { module: module.clone(), evidence });
    }
}

/// Device-only launch names in the bytes `range` of a host file, each once per section (or once
/// outside any).
fn scan_raw<'a>(
    file: &[u8],
    range: std::ops::Range<usize>,
    section: &dyn Fn(usize) -> Option<&'a str>,
    findings: &mut Vec<Finding>,
) {
    let mut seen: Vec<(Option<&str>, &str)> = Vec::new();
    for (offset, name) in identifiers(&file[range.clone()]) {
        if !DEVICE_ONLY_PREFIXES.iter().any(|p| name.starts_with(p)) || !is_launch_entry_point(name) {
            continue;
        }
        let offset = range.start + offset;
        let place = section(offset);
        if seen.contains(&(place, name)) {
            continue;
        }
        seen.push((place, name));
        let location = vec![place.map_or_else(|| format!("bytes at {offset:#x}"), |s| format!("section {s}"))];
        let module = Module { location, kind: None, arch: None, bytes: range.len(), compression: None };
        let evidence =
            Evidence::Launch { symbol: name.to_string(), usage: Usage::Contains { offset }, callers: vec![] };
        findings.push(Finding { module, evidence });
    }
}

/// The identifiers in `data` (maximal runs of ASCII letters, digits, `_` and `$`, as PTX and symbol
/// names spell them), with their offsets.
fn identifiers(data: &[u8]) -> impl Iterator<Item = (usize, &str)> {
    let is_ident = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$';
    let mut at = 0;
    std::iter::from_fn(move || {
        let start = at + data.get(at..)?.iter().position(is_ident)?;
        let len = data[start..].iter().position(|b| !is_ident(b)).unwrap_or(data.len() - start);
        at = start + len;
        // ASCII by construction, so always UTF-8.
        Some((start, std::str::from_utf8(&data[start..at]).unwrap_or_default()))
    })
}

/// The first position of `needle` in `haystack` at or after `from`.
fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// Little-endian reads that return `None` instead of panicking past the end.
mod bytes {
    fn array<const N: usize>(d: &[u8], at: usize) -> Option<[u8; N]> {
        d.get(at..at.checked_add(N)?)?.try_into().ok()
    }

    pub fn u16_at(d: &[u8], at: usize) -> Option<u16> {
        array(d, at).map(u16::from_le_bytes)
    }

    pub fn u32_at(d: &[u8], at: usize) -> Option<u32> {
        array(d, at).map(u32::from_le_bytes)
    }

    pub fn u64_at(d: &[u8], at: usize) -> Option<u64> {
        array(d, at).map(u64::from_le_bytes)
    }
}

#[cfg(test)]
pub(crate) mod tests;
