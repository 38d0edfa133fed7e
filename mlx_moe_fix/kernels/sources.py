"""Kernel sources shipped as package data, split into named sections on `//// <name>` lines.

The `header` section of each source gets the backend's shared helpers (`common.cuh`) in front,
then the headers of the sources it names on a `//// uses <file> ...` line (without their own
`uses`): cuda_kernel compiles each kernel on its own, with no include path to this package.

Sections come without comments, indentation or blank lines: MLX copies a kernel's whole source
into every call's primitive and hashes it at every evaluation (mlx/backend/cuda/custom_kernel.cpp),
host time that a decode step pays twice per layer."""

from __future__ import annotations

import functools
import re
from importlib import resources

COMMON = {"cuda": "common.cuh", "metal": "common.metal"}


@functools.lru_cache(maxsize=None)
def sections(backend: str, filename: str) -> dict:
    named = _own_sections(backend, filename)
    used = "".join(_own_sections(backend, name).get("header", "") for name in named.pop("uses", "").split())
    named["header"] = _folder(backend).joinpath(COMMON[backend]).read_text() + used + named.get("header", "")
    return {name: compact(body) for name, body in named.items()}


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
