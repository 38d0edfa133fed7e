"""A cubin's contents with the symbol table's order, the layout of zero-filled globals and the
order of the global address table taken out, to compare two compiles of one kernel.

With NVRTC's precompiled header the H200's NVRTC lists the same symbols in another order, lays
out eight one-byte cuda::std constants (all false, so in the zero-filled .nv.global section) at
one another's offsets, and fills the slots of the global address table in .nv.constant4 (each
slot relocated to one global's address) in another order (docs/benchmarks.md, forty-seventh
session item 8, forty-eighth session item 1): the machine code, the initialised data and the set
of addresses in the table are the same, but the symbol table, the relocations and the .nv.info
records that name symbols by index are not byte for byte. So every section's bytes are compared
except those; the symbol table is compared with a zero-filled symbol taken by its section and
size only (any two such of one size hold the same bytes), the relocations with each symbol index
replaced by the symbol it names, and those into a constant bank's address table without their
slot's offset. That last step cannot tell whether the code reads a slot whose global moved: the
code is the same bytes, and the table's permuted slots are cuda::std's compile-time constants,
folded where the kernel uses them (the patched model's log-probabilities were bitwise the same in
every process, forty-seventh session item 1). The .nv.info and .nv.callgraph sections (records
holding symbol indices among other fields) are compared by name and size only."""

import struct
from collections import Counter

_SYMTAB, _STRTAB, _RELA, _NOBITS, _REL = 2, 3, 4, 8, 9
_SYMBOL_INDEXED = (_SYMTAB, _STRTAB, _RELA, _REL)


def _sections(cubin: bytes):
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a little-endian 64-bit ELF")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(offset, base=names_at):
        return cubin[base + offset:cubin.index(b"\0", base + offset)].decode()

    return [{"name": name(h[0]), "type": h[1], "flags": h[2], "offset": h[4], "size": h[5], "link": h[6],
             "info": h[7], "entsize": h[9], "data": cubin[h[4]:h[4] + h[5]] if h[1] != _NOBITS else b""} for h in headers], name


def normalised(cubin: bytes) -> dict:
    """What must be equal in two compiles of one kernel, whatever order their symbols are listed in."""
    sections, name = _sections(cubin)
    symtab = next(s for s in sections if s["type"] == _SYMTAB)
    strings_at = sections[symtab["link"]]["offset"]
    symbols = []
    for at in range(0, symtab["size"], symtab["entsize"]):
        st_name, st_info, st_other, st_shndx, st_value, st_size = struct.unpack_from("<IBBHQQ", symtab["data"], at)
        section = sections[st_shndx] if 0 < st_shndx < len(sections) else None
        if section is not None and section["type"] == _NOBITS and st_size > 0:
            symbols.append((f"zero-filled {st_size} bytes", st_info, st_other, section["name"], None, st_size))
        else:
            symbols.append((name(st_name, strings_at), st_info, st_other, st_shndx if section is None else section["name"],
                            st_value, st_size))
    relocations = Counter()
    for s in sections:
        if s["type"] in (_REL, _RELA):
            for at in range(0, s["size"], s["entsize"]):
                offset, info = struct.unpack_from("<QQ", s["data"], at)
                addend = struct.unpack_from("<q", s["data"], at + 16)[0] if s["type"] == _RELA else None
                target = sections[s["info"]]["name"]
                slot = None if target.startswith(".nv.constant") else offset
                relocations[(target, slot, info & 0xFFFFFFFF, symbols[info >> 32][0], addend)] += 1
    return {
        "sections": [(s["name"], s["type"], s["flags"], s["size"]) for s in sections],
        "bytes": {s["name"]: s["data"] for s in sections
                  if s["type"] not in _SYMBOL_INDEXED and not s["name"].startswith((".nv.info", ".nv.callgraph"))},
        "symbols": Counter(symbols),
        "relocations": relocations,
    }
