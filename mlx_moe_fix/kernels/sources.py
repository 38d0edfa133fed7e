"""Kernel sources shipped as package data, split into named sections on `//// <name>` lines.

The `header` section of each source gets the backend's shared helpers (`common.cuh`) in front:
cuda_kernel compiles each kernel on its own, with no include path to this package."""

from __future__ import annotations

import functools
import re
from importlib import resources

COMMON = {"cuda": "common.cuh"}


@functools.lru_cache(maxsize=None)
def sections(backend: str, filename: str) -> dict:
    folder = resources.files(__package__).joinpath(backend)
    parts = re.split(r"^//// (\w+)\s*$", folder.joinpath(filename).read_text(), flags=re.M)
    named = {name: body for name, body in zip(parts[1::2], parts[2::2])}
    named["header"] = folder.joinpath(COMMON[backend]).read_text() + named.get("header", "")
    return named
