"""Kernel sources shipped as package data, split into named sections on `//// <name>` lines."""

from __future__ import annotations

import functools
import re
from importlib import resources


@functools.lru_cache(maxsize=None)
def sections(backend: str, filename: str) -> dict:
    text = resources.files(__package__).joinpath(backend, filename).read_text()
    parts = re.split(r"^//// (\w+)\s*$", text, flags=re.M)
    return {name: body for name, body in zip(parts[1::2], parts[2::2])}
