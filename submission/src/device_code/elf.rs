//! A minimal reader of 64-bit little-endian ELF files: section headers, symbol tables and relocation
//! tables, which is all the device-code scanner needs of a cubin (and of a host library, whose section
//! names locate what it carries). Every read is bounds-checked and every failure is a sentence, so
//! garbage never panics: it becomes a "not inspected" finding.

use super::bytes::{u16_at, u32_at, u64_at};

/// `\x7fELF`.
pub const MAGIC: &[u8; 4] = b"\x7fELF";
/// `e_machine` of NVIDIA GPU code (cubins).
pub const EM_CUDA: u16 = 190;

const CLASS_64: u8 = 2;
const LITTLE_ENDIAN: u8 = 1;
const HEADER_BYTES: usize = 64;
const SECTION_HEADER_BYTES: usize = 64;
const SYMBOL_BYTES: usize = 24;
const RELA_BYTES: usize = 24;
const REL_BYTES: usize = 16;

const SHT_SYMTAB: u32 = 2;
const SHT_RELA: u32 = 4;
const SHT_NOBITS: u32 = 8;
const SHT_REL: u32 = 9;
/// `sh_flags` bit of sections that hold machine code.
const SHF_EXECINSTR: u64 = 0x4;
const STT_FUNC: u8 = 2;
/// `st_shndx` of a symbol the file uses but does not define: someone else (the driver, for a
/// loaded cubin) must bind it.
pub const SHN_UNDEF: u16 = 0;
/// `e_shstrndx` saying "the real index is in section 0's `sh_link`" (more than 65279 sections).
const SHN_XINDEX: u16 = 0xffff;
/// More sections than any real file has; a header claiming more is garbage.
const MAX_SECTIONS: usize = 1 << 20;

/// One section header.
#[derive(Debug, Clone, Copy)]
pub struct Section {
    name: u32,
    kind: u32,
    flags: u64,
    offset: u64,
    size: u64,
    link: u32,
    info: u32,
}

/// One symbol: its name, whether the file defines it, and whether it is a function.
#[derive(Debug, Clone, Copy)]
pub struct Symbol<'a> {
    pub name: &'a str,
    /// The section it is defined in; [`SHN_UNDEF`] for an import.
    pub section: u16,
    is_function: bool,
}

/// A parsed ELF file, borrowing its bytes.
pub struct Elf<'a> {
    data: &'a [u8],
    machine: u16,
    sections: Vec<Section>,
    names: Option<Section>,
}

impl<'a> Elf<'a> {
    /// Parses the header and the section header table; fails with what is wrong.
    pub fn parse(data: &'a [u8]) -> Result<Self, String> {
        if data.len() < HEADER_BYTES || &data[..4] != MAGIC {
            return Err("too short for an ELF header, or no ELF magic".into());
        }
        if data[4] != CLASS_64 || data[5] != LITTLE_ENDIAN {
            return Err(format!(
                "ELF class {} / data encoding {}: only 64-bit little-endian is read",
                data[4], data[5]
            ));
        }
        let field = |what: &str, v: Option<u64>| v.ok_or_else(|| format!("ELF header field {what} unreadable"));
        let machine = field("e_machine", u16_at(data, 18).map(u64::from))? as u16;
        let shoff = field("e_shoff", u64_at(data, 0x28))?;
        let shnum = field("e_shnum", u16_at(data, 0x3c).map(u64::from))? as usize;
        let shstrndx = field("e_shstrndx", u16_at(data, 0x3e).map(u64::from))? as u16;
        let mut elf = Self { data, machine, sections: Vec::new(), names: None };
        if shoff == 0 {
            return Ok(elf);
        }
        let first = elf.section_header(shoff, 0)?;
        // Extended numbering: a count or string-table index too large for the header lives in section 0.
        let count = if shnum == 0 { usize::try_from(first.size).unwrap_or(usize::MAX) } else { shnum };
        if count > MAX_SECTIONS {
            return Err(format!("{count} sections claimed: not a real file"));
        }
        elf.sections = (0..count).map(|i| elf.section_header(shoff, i)).collect::<Result<_, _>>()?;
        let names = if shstrndx == SHN_XINDEX { first.link as usize } else { usize::from(shstrndx) };
        elf.names = elf.sections.get(names).copied();
        Ok(elf)
    }

    fn section_header(&self, table: u64, index: usize) -> Result<Section, String> {
        let at = usize::try_from(table)
            .ok()
            .and_then(|t| t.checked_add(index.checked_mul(SECTION_HEADER_BYTES)?))
            .filter(|at| at.checked_add(SECTION_HEADER_BYTES).is_some_and(|end| end <= self.data.len()))
            .ok_or_else(|| format!("section header {index} lies past the end of the file"))?;
        let d = self.data;
        let read = || -> Option<Section> {
            Some(Section {
                name: u32_at(d, at)?,
                kind: u32_at(d, at + 4)?,
                flags: u64_at(d, at + 8)?,
                offset: u64_at(d, at + 0x18)?,
                size: u64_at(d, at + 0x20)?,
                link: u32_at(d, at + 0x28)?,
                info: u32_at(d, at + 0x2c)?,
            })
        };
        read().ok_or_else(|| format!("section header {index} unreadable"))
    }

    /// `e_machine`: [`EM_CUDA`] for a cubin.
    pub fn machine(&self) -> u16 {
        self.machine
    }

    /// The section's name, or `""` when the name table does not have it.
    pub fn section_name(&self, s: &Section) -> &'a str {
        self.names.and_then(|t| self.string(&t, s.name)).unwrap_or("")
    }

    /// The byte range of a section's contents in the file; `None` for a section that has none.
    pub fn file_range(&self, s: &Section) -> Option<std::ops::Range<usize>> {
        if s.kind == SHT_NOBITS {
            return None;
        }
        let start = usize::try_from(s.offset).ok()?;
        let end = start.checked_add(usize::try_from(s.size).ok()?)?;
        (end <= self.data.len()).then_some(start..end)
    }

    /// The sections, each with its name.
    pub fn sections(&self) -> impl Iterator<Item = (&'a str, Section)> + '_ {
        self.sections.iter().map(|s| (self.section_name(s), *s))
    }

    fn contents(&self, s: &Section, what: &str) -> Result<&'a [u8], String> {
        self.file_range(s).map(|r| &self.data[r]).ok_or_else(|| format!("{what} lies past the end of the file"))
    }

    fn string(&self, table: &Section, offset: u32) -> Option<&'a str> {
        let bytes = self.file_range(table).map(|r| &self.data[r])?;
        let rest = bytes.get(offset as usize..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        std::str::from_utf8(&rest[..end]).ok()
    }

    /// The indices of the symbol tables.
    pub fn symbol_tables(&self) -> impl Iterator<Item = usize> + '_ {
        self.sections.iter().enumerate().filter(|(_, s)| s.kind == SHT_SYMTAB).map(|(i, _)| i)
    }

    /// The symbols of symbol table `table` (an index from [`Elf::symbol_tables`]).
    pub fn symbols(&self, table: usize) -> Result<Vec<Symbol<'a>>, String> {
        let symtab = self.sections[table];
        let bytes = self.contents(&symtab, "the symbol table")?;
        let strings =
            *self.sections.get(symtab.link as usize).ok_or("the symbol table's string table does not exist")?;
        self.contents(&strings, "the symbol names")?;
        Ok(bytes
            .chunks_exact(SYMBOL_BYTES)
            .map(|sym| {
                // In range: chunks_exact yields SYMBOL_BYTES bytes; st_name, st_info and st_shndx end at 8.
                let name = u32_at(sym, 0).unwrap_or(0);
                Symbol {
                    name: self.string(&strings, name).unwrap_or(""),
                    section: u16_at(sym, 6).unwrap_or(SHN_UNDEF),
                    is_function: sym[4] & 0xf == STT_FUNC,
                }
            })
            .collect())
    }

    /// For each symbol of `table` that machine code refers to (a call, an address taken), the
    /// functions whose code does: `(symbol index, caller)` pairs, one per relocation.
    pub fn code_references(&self, table: usize, symbols: &[Symbol<'a>]) -> Result<Vec<(usize, &'a str)>, String> {
        let mut refs = Vec::new();
        for rel in
            self.sections.iter().filter(|s| (s.kind == SHT_RELA || s.kind == SHT_REL) && s.link as usize == table)
        {
            let Some(target) = self.sections.get(rel.info as usize).filter(|t| t.flags & SHF_EXECINSTR != 0) else {
                continue;
            };
            let caller = self.function_in(rel.info as usize, symbols).unwrap_or_else(|| {
                let name = self.section_name(target);
                name.strip_prefix(".text.").unwrap_or(name)
            });
            let entry = if rel.kind == SHT_RELA { RELA_BYTES } else { REL_BYTES };
            for r in self.contents(rel, "a relocation table")?.chunks_exact(entry) {
                // r_info's high half is the symbol index; chunks_exact guarantees its 8 bytes.
                let symbol = u64_at(r, 8).map_or(0, |info| (info >> 32) as usize);
                refs.push((symbol, caller));
            }
        }
        Ok(refs)
    }

    /// The function defined at the start of code section `section`: nvcc gives each function its own.
    fn function_in(&self, section: usize, symbols: &[Symbol<'a>]) -> Option<&'a str> {
        symbols
            .iter()
            .find(|s| s.is_function && usize::from(s.section) == section && !s.name.is_empty())
            .map(|s| s.name)
    }
}
