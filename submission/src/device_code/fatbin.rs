//! The fatbin container that nvcc and fatbinary write, as CUDA 13.0 writes it: a 16-byte header
//! (magic 0xBA55ED50, version 1, header size, size of what follows), then entries, each a header and
//! one payload (a cubin, PTX text or LTO-IR for one architecture), possibly compressed. nvcc 13.0
//! compresses PTX by default and every entry with `-Xfatbin -compress-all`; `-compress-mode` picks
//! zstd (`default`, `size`, `balance`) or LZ4 (`speed`), told apart by the entry's flags.

use std::borrow::Cow;
use std::io::Read;

use super::bytes::{u16_at, u32_at, u64_at};

/// The container's magic number, little-endian at offset 0.
pub const MAGIC: u32 = 0xBA55_ED50;
/// The only container version nvcc writes.
const VERSION: u16 = 1;
/// Bytes of the container header.
pub const HEADER_BYTES: usize = 16;
/// Bytes of the fixed part of an entry header (nvcc writes 64, 80, 112 or 120).
const ENTRY_HEADER_MIN: usize = 64;

/// Entry kinds.
const KIND_PTX: u16 = 1;
const KIND_CUBIN: u16 = 2;
const KIND_LTO_IR: u16 = 8;

/// Entry flag bits that say how the payload is compressed.
const FLAG_LZ4: u64 = 0x2000;
const FLAG_ZSTD: u64 = 0x8000;
const COMPRESSION_FLAGS: u64 = FLAG_LZ4 | FLAG_ZSTD;

/// The most an entry may inflate to: far above any real module (the megakernel's cubin is well under
/// a megabyte), low enough that a forged size cannot exhaust the grader's memory.
const MAX_INFLATED: u64 = 512 << 20;
/// LZ4 cannot compress better than 255:1, so a larger ratio is a forged size.
const LZ4_MAX_RATIO: u64 = 255;

/// What an entry holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    Cubin,
    Ptx,
    /// Link-time-optimisation IR (`-dlto`), in no documented form, which the driver never loads as it is.
    LtoIr,
    Other(u16),
}

/// How an entry is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Lz4,
    Zstd,
}

/// One entry of a fatbin.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub payload: Payload,
    /// The SM version (90 for sm_90 and sm_90a).
    pub arch: u32,
    flags: u64,
    /// The payload as stored, padding included.
    pub stored: &'a [u8],
    compressed_bytes: u32,
    inflated_bytes: u64,
}

/// A fatbin's entries, and why reading stopped early, if it did.
pub struct Fatbin<'a> {
    pub entries: Vec<Entry<'a>>,
    pub truncated: Option<String>,
}

/// Whether `data` starts with the container magic.
pub fn starts_with_magic(data: &[u8]) -> bool {
    u32_at(data, 0) == Some(MAGIC)
}

/// Reads the container header at the start of `data` and returns the container's length; fails with
/// what is wrong when it is no fatbin this scanner reads, or does not fit in `data`.
pub fn container_len(data: &[u8]) -> Result<usize, String> {
    if !starts_with_magic(data) {
        return Err("no fatbin magic".into());
    }
    let (Some(version), Some(header), Some(size)) = (u16_at(data, 4), u16_at(data, 6), u64_at(data, 8)) else {
        return Err("the fatbin header is cut short".into());
    };
    if version != VERSION || usize::from(header) != HEADER_BYTES {
        return Err(format!(
            "fatbin version {version} with a {header}-byte header: this scanner reads version {VERSION} ({HEADER_BYTES} bytes)"
        ));
    }
    usize::try_from(size).ok().and_then(|s| s.checked_add(HEADER_BYTES)).filter(|&len| len <= data.len()).ok_or_else(
        || format!("the fatbin claims {size} bytes of entries, but only {} follow", data.len() - HEADER_BYTES),
    )
}

/// Parses the fatbin at the start of `data`.
pub fn parse(data: &[u8]) -> Result<Fatbin<'_>, String> {
    let len = container_len(data)?;
    let mut fatbin = Fatbin { entries: Vec::new(), truncated: None };
    let mut at = HEADER_BYTES;
    while at < len {
        match entry(&data[..len], at) {
            Ok((e, next)) => {
                fatbin.entries.push(e);
                at = next;
            }
            Err(why) => {
                fatbin.truncated = Some(why);
                break;
            }
        }
    }
    Ok(fatbin)
}

/// The entry whose header starts at `at`, and where the next one starts.
fn entry(data: &[u8], at: usize) -> Result<(Entry<'_>, usize), String> {
    // Saturates past the end, where every read fails.
    let field = |offset: usize| at.saturating_add(offset);
    let read = || -> Option<(u16, usize, u64, Entry<'_>)> {
        let header = u32_at(data, field(4))? as usize;
        let stored = u64_at(data, field(8))?;
        let kind = u16_at(data, at)?;
        let payload = match kind {
            KIND_CUBIN => Payload::Cubin,
            KIND_PTX => Payload::Ptx,
            KIND_LTO_IR => Payload::LtoIr,
            other => Payload::Other(other),
        };
        let e = Entry {
            payload,
            arch: u32_at(data, field(28))?,
            flags: u64_at(data, field(40))?,
            stored: &[],
            compressed_bytes: u32_at(data, field(16))?,
            inflated_bytes: u64_at(data, field(56))?,
        };
        Some((kind, header, stored, e))
    };
    let (kind, header, stored, mut e) =
        read().ok_or_else(|| format!("an entry header at byte {at} runs past the container's end"))?;
    if header < ENTRY_HEADER_MIN {
        return Err(format!(
            "the entry header at byte {at} (kind {kind}) claims {header} bytes, fewer than {ENTRY_HEADER_MIN}"
        ));
    }
    let start = at.checked_add(header);
    let end = start.and_then(|s| s.checked_add(usize::try_from(stored).ok()?));
    match (start, end) {
        (Some(start), Some(end)) if end <= data.len() => {
            e.stored = &data[start..end];
            Ok((e, end))
        }
        _ => Err(format!("the entry at byte {at} (kind {kind}) claims {stored} bytes, past the container's end")),
    }
}

impl<'a> Entry<'a> {
    /// How the payload is compressed; fails for flags this scanner does not know.
    pub fn compression(&self) -> Result<Option<Compression>, String> {
        match self.flags & COMPRESSION_FLAGS {
            0 => Ok(None),
            FLAG_LZ4 => Ok(Some(Compression::Lz4)),
            FLAG_ZSTD => Ok(Some(Compression::Zstd)),
            _ => Err(format!("compressed with an unknown method (flags {:#x})", self.flags)),
        }
    }

    /// The payload, inflated if it is compressed.
    pub fn contents(&self) -> Result<Cow<'a, [u8]>, String> {
        let Some(compression) = self.compression()? else {
            return Ok(Cow::Borrowed(self.stored));
        };
        let compressed = self.stored.get(..self.compressed_bytes as usize).ok_or_else(|| {
            format!("claims {} compressed bytes in {} stored", self.compressed_bytes, self.stored.len())
        })?;
        if self.inflated_bytes > MAX_INFLATED {
            return Err(format!(
                "claims {} bytes uncompressed, over the {} MiB this scanner inflates",
                self.inflated_bytes,
                MAX_INFLATED >> 20
            ));
        }
        match compression {
            Compression::Lz4 => inflate_lz4(compressed, self.inflated_bytes),
            Compression::Zstd => inflate_zstd(compressed, self.inflated_bytes),
        }
        .map(Cow::Owned)
    }
}

/// An LZ4 block (no frame: the entry header carries both sizes).
fn inflate_lz4(compressed: &[u8], inflated: u64) -> Result<Vec<u8>, String> {
    if inflated > (compressed.len() as u64).saturating_mul(LZ4_MAX_RATIO) {
        return Err(format!("claims {inflated} bytes from {} LZ4 bytes, more than LZ4 can encode", compressed.len()));
    }
    let mut out = vec![0; inflated as usize];
    let n =
        lz4_flex::block::decompress_into(compressed, &mut out).map_err(|e| format!("the LZ4 data is corrupt: {e}"))?;
    out.truncate(n);
    Ok(out)
}

/// A zstd frame, inflated to at most the size the header claims (or [`MAX_INFLATED`] if it claims none).
fn inflate_zstd(compressed: &[u8], inflated: u64) -> Result<Vec<u8>, String> {
    let limit = if inflated == 0 { MAX_INFLATED } else { inflated };
    let corrupt = |e: &dyn std::fmt::Display| format!("the zstd data is corrupt: {e}");
    let decoder = ruzstd::decoding::StreamingDecoder::new(compressed).map_err(|e| corrupt(&e))?;
    let mut out = Vec::new();
    decoder.take(limit).read_to_end(&mut out).map_err(|e| corrupt(&e))?;
    Ok(out)
}
