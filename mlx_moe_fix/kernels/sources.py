"""Kernel sources shipped as package data, split into named sections on `//// <name>` lines.

The `header` section of each source gets the backend's shared helpers (`common.cuh`) in front,
then the headers of the sources it names on a `//// uses <file> ...` line (without their own
`uses`): cuda_kernel compiles each kernel on its own, with no include path to this package.

Sections come without comments, indentation or blank lines: MLX copies a kernel's whole source
into every call's primitive and hashes it at every evaluation (mlx/backend/cuda/custom_kernel.cpp),
host time that a decode step pays twice per layer: on the H200's host ~0.3 µs per KB and launch
(docs/benchmarks.md, eleventh session). So a CUDA kernel gets `cuda_kernel_source`: of its file's
header, only the declarations its body reaches, with no blanks beside punctuation, and MLX gets
that header as one `#include` line of a file holding it (`cuda_header_directive`): the hashed
source is then the body and its signature, ~1-2 KB where the header alone is 7-13 KB."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from importlib import resources
from pathlib import Path

COMMON = {"cuda": "common.cuh", "metal": "common.metal"}


@functools.lru_cache(maxsize=None)
def sections(backend: str, filename: str) -> dict:
    return {name: compact(body) for name, body in _with_full_header(backend, filename).items()}


def _with_full_header(backend: str, filename: str) -> dict:
    """The file's sections as written, `header` being the common helpers, then the headers of the
    files it uses, then its own."""
    named = _own_sections(backend, filename)
    used = "".join(_own_sections(backend, name).get("header", "") for name in named.pop("uses", "").split())
    named["header"] = _folder(backend).joinpath(COMMON[backend]).read_text() + used + named.get("header", "")
    return named


@functools.lru_cache(maxsize=None)
def cuda_kernel_source(filename: str, section: str) -> tuple:
    """(header, body) of the CUDA kernel `section` of cuda/`filename`, as compiled: the header is
    sections()'s less the namespace-level declarations that the body does not reach, directly or
    through the declarations kept (a declaration starts on a line at column 0, the sources' style;
    one whose name this cannot read is kept, so a misread keeps too much, never too little)."""
    named = _with_full_header("cuda", filename)
    declarations = _declarations(named["header"])
    reached = set(re.findall(r"\w+", compact(named[section])))
    kept = [name is None for name, _ in declarations]
    grew = True
    while grew:
        grew = False
        for i, (name, text) in enumerate(declarations):
            if not kept[i] and name in reached:
                kept[i] = grew = True
                reached |= set(re.findall(r"\w+", text))
    return "".join(_tight(text) for (_, text), keep in zip(declarations, kept) if keep), _tight(compact(named[section]))


# A line that starts a declaration at namespace level (the sources' style: column 0), where the
# item before it has ended.
_DECLARATION_START = re.compile(r"^(template\b|__device__\b|struct\b|constexpr\b|inline\b|using\b|#(?!pragma))")
_NAMED = (
    re.compile(r"^(?:template\s*<[^{;]*?>\s*)?struct\s+(?:(?:alignas|__align__)\s*\([^)]*\)\s*)?(\w+)"),
    re.compile(r"^(?:template\s*<[^{;]*?>\s*)?(?:inline\s+)?constexpr\s[^=(]*?(\w+)\s*="),
    re.compile(r"^(?:template\s*<[^{;]*?>\s*)?__device__[^(]*?(\w+)\s*\("),
    re.compile(r"^(?:template\s*<[^{;]*?>\s*)?using\s+(\w+)\s*="),
)


def _declarations(source: str) -> list:
    """[(name or None, compacted text)] of the items of `source` at namespace level, in order:
    each declaration (from its template lines on, up to the `}` or `;` that ends it), and each
    namespace's opening and closing line as items of their own (no name: always kept)."""
    items, lines, braces = [], [], []  # braces: for each open brace, whether a namespace opened it
    for raw in source.splitlines():
        line = compact(raw).strip()
        if not line:
            continue
        at_namespace_level = all(braces)
        opens_namespace = line.startswith("namespace")
        closes_namespace = at_namespace_level and bool(braces) and line.startswith("}")
        finished = not lines or lines[-1].endswith(("}", ";")) or lines[-1].startswith("#")  # not a template line
        if at_namespace_level and (opens_namespace or closes_namespace or (_DECLARATION_START.match(raw) and finished)):
            items.append(lines)
            lines = []
        lines.append(line)
        for char in line:
            if char == "{":
                braces.append(opens_namespace)
            elif char == "}":
                braces.pop()
        if opens_namespace or closes_namespace:
            items.append(lines)
            lines = []
    items.append(lines)
    out = []
    for item in filter(None, items):
        flat = " ".join(item)
        name = next((m.group(1) for m in (pattern.match(flat) for pattern in _NAMED) if m), None)
        out.append((name, "".join(line + "\n" for line in item)))
    return out


_STRING_LITERAL = re.compile(r'("(?:[^"\\]|\\.)*")')


def _tight(text: str) -> str:
    """`text` without blanks between a word character and punctuation (either order), outside
    preprocessor lines and string literals: C++ reads it the same (blanks between two words or two
    punctuation marks, as in `a - -b`, stay), and inline PTX keeps its own spacing (`wait_group %0`
    would become `wait_group1`)."""
    def tighten(line: str) -> str:
        parts = _STRING_LITERAL.split(line)  # odd indices: the literals
        return "".join(part if i % 2 else re.sub(r"(?<=[^\w\s]) +(?=\w)|(?<=\w) +(?=[^\w\s])", "", part)
                       for i, part in enumerate(parts))

    return "".join(line + "\n" if line.startswith("#") else tighten(line) + "\n" for line in text.splitlines())


def _folder(backend: str):
    return resources.files(__package__).joinpath(backend)


def _own_sections(backend: str, filename: str) -> dict:
    """The sections as written in the file; `uses` holds the names on its `//// uses` line."""
    parts = re.split(r"^//// (\w+)(.*)$", _folder(backend).joinpath(filename).read_text(), flags=re.M)
    return {name: rest if name == "uses" else body for name, rest, body in zip(parts[1::3], parts[2::3], parts[3::3])}


def compact(source: str) -> str:
    """`source` without `//` comments (the sources put none inside string literals), leading and
    trailing blanks, or empty lines; line breaks stay (preprocessor lines need them)."""
    lines = (re.sub(r"//.*", "", line).strip() for line in source.splitlines())
    return "".join(line + "\n" for line in lines if line)


def header_directory() -> Path:
    """Where cuda_header_directive writes headers: the user's cache (XDG_CACHE_HOME, else
    ~/.cache), under mlx_moe_fix/cuda-headers."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "mlx_moe_fix" / "cuda-headers"


@functools.lru_cache(maxsize=None)
def cuda_header_directive(header: str) -> str:
    """`header` as a cuda_kernel should get it: `#include "<file>"` of a file in header_directory()
    that holds exactly `header` (named by its digest; written, or rewritten where it differs, once
    per process), which NVRTC reads at compile time; or `header` itself where no such file can be
    used (the directory cannot be written, is not the user's own, or its path cannot be quoted in
    an #include). A decode step's two launches per layer then hash ~15 KB less source. NVRTC
    reads the file when MLX compiles a template variant, which may be later in the process: the
    file must stay (a cache cleaner that deletes it mid-run makes that compile fail)."""
    try:
        directory = header_directory()
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if hasattr(os, "getuid") and directory.stat().st_uid != os.getuid():
            return header  # another user's directory: its files could change under us
        path = directory / f"{hashlib.sha1(header.encode()).hexdigest()[:20]}.cuh"
        quoted = str(path)
        if not quoted.isascii() or any(c in quoted for c in '"\\\n'):
            return header
        if not path.is_file() or path.read_text(encoding="utf-8") != header:
            partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
            partial.write_text(header, encoding="utf-8")
            os.replace(partial, path)
        return f'#include "{quoted}"\n'
    except (OSError, UnicodeError):
        return header
