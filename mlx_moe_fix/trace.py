"""Which path each patched call took (kernel, reference or stock) and why.

Every call is counted (`path_counts()`); with MLX_MOE_FIX_TRACE=1 the first call of each
(layer kind, shape class, path) is also logged to stderr.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import NamedTuple

logger = logging.getLogger("mlx_moe_fix")


class PathRecord(NamedTuple):
    layer: str
    phase: str
    path: str
    reason: str


_counts: Counter = Counter()
_logged: set = set()


def tracing_enabled() -> bool:
    return os.environ.get("MLX_MOE_FIX_TRACE", "") not in ("", "0")


def record(layer: str, phase: str, path: str, reason: str, shape_class: tuple) -> None:
    _counts[PathRecord(layer, phase, path, reason)] += 1
    key = (layer, shape_class, path)
    if key in _logged or not tracing_enabled():
        return
    _logged.add(key)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[mlx-moe-fix] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    logger.info("%s %s %s -> %s (%s)", layer, phase, shape_class, path, reason)


def path_counts() -> dict:
    """{PathRecord(layer, phase, path, reason): calls} since the last reset."""
    return dict(_counts)


def reset_path_counts() -> None:
    _counts.clear()
    _logged.clear()
